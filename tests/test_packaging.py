"""`pip install .` into a fresh virtualenv gives a working `kvgate` command and the kvgate.* packages."""
from __future__ import annotations

import os
import site
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pip_install_into_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # dependencies (torch, transformers, ...) come from the test environment, so nothing is downloaded;
    # the package itself is built and installed from the source tree like any user would
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    build = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                            "--no-build-isolation", str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    help_out = subprocess.run([str(venv / "bin" / "kvgate"), "--help"], capture_output=True, text=True,
                              cwd=tmp_path, env=env)
    assert help_out.returncode == 0, help_out.stderr
    assert "generate" in help_out.stdout and "convert" in help_out.stdout
    where = subprocess.run([str(py), "-c", "import kvgate.engine, kvgate.kernels, kvgate.gateway;"
                            "print(kvgate.engine.__file__)"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the installed copy, not the source tree
    for generic in ("engine", "kernels", "gateway"):  # no generic top-level names are installed
        assert not Path(purelib, generic).exists()
    meta = subprocess.run([str(py), "-c", "import importlib.metadata as m; d = m.distribution('kvgate');"
                           "print(d.metadata['License-Expression'], d.version);"
                           "print(any(str(f).endswith('LICENSE') for f in d.files))"],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert meta.stdout.split() == ["Apache-2.0", declared, "True"], meta.stdout + meta.stderr
    version = subprocess.run([str(venv / "bin" / "kvgate"), "--version"], capture_output=True, text=True, env=env)
    assert version.stdout.strip() == f"kvgate {declared}"


def test_kvgate_dify_package_builds_the_plugin(tmp_path, capsys) -> None:
    import zipfile

    from kvgate.gateway.cli import main

    assert main(["dify-package", "--out-dir", str(tmp_path)]) == 0
    (pkg,) = tmp_path.glob("kvgate-*.difypkg")
    names = set(zipfile.ZipFile(pkg).namelist())
    assert {"manifest.yaml", "main.py", "provider/kvgate.yaml", "models/llm/llm.py"} <= names
    assert not any(n.startswith(("tests/", ".env")) and n != ".env.example" for n in names)
    assert main(["dify-package", "--plugin-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
