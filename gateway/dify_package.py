"""`kvgate dify-package`: build the Dify plugin package (dist/kvgate-<version>.difypkg) from dify_plugin/.

Like Dify's own `dify plugin package`: the package is a zip of the plugin directory, paths relative to it, minus
what .difyignore (gitignore syntax; .gitignore if there is no .difyignore) leaves out, at most 50 MiB unpacked;
manifest.yaml is checked first (required fields, name and version formats, and that every file it or its provider
yaml refers to is in the package). Entries are sorted and dated 1980-01-01, so the same tree gives the same bytes.

    python -m kvgate.gateway.dify_package [--plugin-dir dify_plugin] [--out-dir dist]
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

MAX_PACKAGE_BYTES = 50 * 1024 * 1024  # unpacked size limit of `dify plugin package`
VERSION_RE = re.compile(r"^\d{1,4}(\.\d{1,4}){2}(-\w{1,16})?$")
NAME_RE = re.compile(r"^[a-z0-9_-]{1,128}$")
AUTHOR_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
ARCHS = ("amd64", "arm64")
PLUGIN_KINDS = ("tools", "models", "endpoints", "agent_strategies", "datasources", "triggers")
REQUIRED = ("version", "type", "author", "name", "label", "description", "icon", "created_at", "resource",
            "plugins", "meta")
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class PackageError(ValueError):
    """The plugin directory cannot be packaged; the message lists every problem found."""


# ---- .difyignore ------------------------------------------------------------------------------------------------
def _glob_regex(glob: str) -> str:
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out, i = out + "(?:/.*)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "?":
            out, i = out + "[^/]", i + 1
        elif glob[i] == "[" and "]" in glob[i + 1:]:
            end = glob.index("]", i + 1)
            out, i = out + "[" + glob[i + 1:end].replace("!", "^", 1) + "]", end + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return out


class IgnoreRules:
    """gitignore rules: `#` comments, `!` re-includes, a trailing `/` matches directories only, a pattern with a
    `/` is anchored at the plugin root (others match at any depth), `*`, `?`, `[...]` and `**`; the last match wins."""

    def __init__(self, lines: list[str]) -> None:
        self.rules: list[tuple[re.Pattern[str], bool, bool]] = []  # (regex, negated, directories only)
        for raw in lines:
            line = raw.rstrip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            line = line[1:] if negated else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            body = _glob_regex(line.lstrip("/"))
            self.rules.append((re.compile(("^" if anchored else "^(?:.*/)?") + body + "$"), negated, dir_only))

    @classmethod
    def for_directory(cls, root: Path) -> "IgnoreRules":
        for name in (".difyignore", ".gitignore"):
            if (root / name).is_file():
                return cls((root / name).read_text(encoding="utf-8").splitlines())
        return cls([])

    def ignored(self, rel_path: str, is_dir: bool) -> bool:
        result = False
        for regex, negated, dir_only in self.rules:
            if (is_dir or not dir_only) and regex.match(rel_path):
                result = not negated
        return result


def collect_files(plugin_dir: Path) -> list[str]:
    """The plugin's files (posix paths relative to plugin_dir, sorted) that .difyignore keeps."""
    rules, files = IgnoreRules.for_directory(plugin_dir), []
    for dirpath, dirnames, filenames in os.walk(plugin_dir):
        rel_dir = Path(dirpath).relative_to(plugin_dir).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not rules.ignored(prefix + d, True))
        files += [prefix + f for f in filenames if not rules.ignored(prefix + f, False)]
    return sorted(files)


# ---- manifest.yaml ----------------------------------------------------------------------------------------------
def _load_yaml(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        problems.append(f"{path.name}: cannot read it: {e}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path.name}: expected a mapping of fields, got {type(data).__name__}")
        return {}
    return data


def _i18n_en(value: Any) -> str | None:
    return value.get("en_US") if isinstance(value, dict) else None


def _check_provider(plugin_dir: Path, rel: str, files: set[str], problems: list[str]) -> None:
    """A model provider yaml: its name, model types, icons and Python sources."""
    provider = _load_yaml(plugin_dir / rel, problems)
    where = rel
    if not provider:
        return
    for key in ("provider", "label", "supported_model_types", "configurate_methods"):
        if not provider.get(key):
            problems.append(f"{where}: required field {key!r} is missing or empty")
    for key in ("icon_small", "icon_large"):
        for lang, icon in (provider.get(key) or {}).items():
            if icon and f"_assets/{icon}" not in files:
                problems.append(f"{where}: {key}.{lang} refers to _assets/{icon}, which is not in the package")
    python = ((provider.get("extra") or {}).get("python") or {})
    sources = [python.get("provider_source")] + list(python.get("model_sources") or [])
    if not python.get("provider_source"):
        problems.append(f"{where}: extra.python.provider_source is missing")
    for source in filter(None, sources):
        if source not in files:
            problems.append(f"{where}: refers to {source}, which is not in the package")


def validate_manifest(plugin_dir: Path, files: set[str]) -> dict[str, Any]:
    """Check manifest.yaml against the packaged `files`; return it, or raise PackageError listing every problem."""
    if "manifest.yaml" not in files:
        raise PackageError(f"{plugin_dir}: manifest.yaml is missing (or left out by .difyignore)")
    problems: list[str] = []
    m = _load_yaml(plugin_dir / "manifest.yaml", problems)
    if problems:
        raise PackageError("; ".join(problems))
    problems += [f"manifest.yaml: required field {k!r} is missing" for k in REQUIRED if m.get(k) in (None, "", {})]
    if m.get("type") not in (None, "plugin"):
        problems.append(f"manifest.yaml: type must be 'plugin', got {m.get('type')!r}")
    for key, regex, rule in (("version", VERSION_RE, "x.y.z, each 1-4 digits, optionally -suffix"),
                             ("name", NAME_RE, "1-128 of a-z 0-9 _ -"), ("author", AUTHOR_RE, "1-64 of a-z 0-9 _ -")):
        if m.get(key) is not None and not regex.match(str(m[key])):
            problems.append(f"manifest.yaml: {key} {str(m[key])!r} is not valid ({rule})")
    for key in ("label", "description"):
        if m.get(key) and not _i18n_en(m[key]):
            problems.append(f"manifest.yaml: {key}.en_US is required")
    created = m.get("created_at")
    if isinstance(created, str):
        try:
            datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
        except ValueError:
            problems.append(f"manifest.yaml: created_at {created!r} is not an ISO 8601 date-time")
    memory = (m.get("resource") or {}).get("memory") if isinstance(m.get("resource"), dict) else None
    if m.get("resource") and not (isinstance(memory, int) and memory > 0):
        problems.append(f"manifest.yaml: resource.memory must be a positive number of bytes, got {memory!r}")
    for key in ("icon", "icon_dark"):
        if m.get(key) and f"_assets/{m[key]}" not in files:
            problems.append(f"manifest.yaml: {key} refers to _assets/{m[key]}, which is not in the package")
    if m.get("privacy") and m["privacy"] not in files:
        problems.append(f"manifest.yaml: privacy refers to {m['privacy']}, which is not in the package")
    _check_meta(m.get("meta"), files, problems)
    plugins = m.get("plugins") if isinstance(m.get("plugins"), dict) else {}
    declared = [(kind, rel) for kind in PLUGIN_KINDS for rel in plugins.get(kind) or []]
    if m.get("plugins") and not declared:
        problems.append(f"manifest.yaml: plugins declares nothing (one of {', '.join(PLUGIN_KINDS)} is needed)")
    for kind, rel in declared:
        if rel not in files:
            problems.append(f"manifest.yaml: plugins.{kind} refers to {rel}, which is not in the package")
        elif kind == "models":
            _check_provider(plugin_dir, rel, files, problems)
    if problems:
        raise PackageError("the plugin cannot be packaged:\n  " + "\n  ".join(problems))
    return m


def _check_meta(meta: Any, files: set[str], problems: list[str]) -> None:
    if not isinstance(meta, dict):
        return
    if meta.get("version") is None or not VERSION_RE.match(str(meta["version"])):
        problems.append(f"manifest.yaml: meta.version (the manifest format, e.g. 0.0.1) is invalid: "
                        f"{meta.get('version')!r}")
    arch = meta.get("arch") or []
    if not arch or any(a not in ARCHS for a in arch):
        problems.append(f"manifest.yaml: meta.arch must list some of {', '.join(ARCHS)}, got {arch!r}")
    runner = meta.get("runner") if isinstance(meta.get("runner"), dict) else {}
    if runner.get("language") != "python":
        problems.append(f"manifest.yaml: meta.runner.language must be 'python', got {runner.get('language')!r}")
    if not runner.get("version"):
        problems.append("manifest.yaml: meta.runner.version (the Python version, e.g. '3.12') is missing")
    entry = runner.get("entrypoint")
    if not entry:
        problems.append("manifest.yaml: meta.runner.entrypoint is missing")
    elif f"{entry}.py" not in files:
        problems.append(f"manifest.yaml: meta.runner.entrypoint {entry!r} needs {entry}.py in the package")
    if runner.get("language") == "python" and not {"requirements.txt", "pyproject.toml"} & files:
        problems.append("manifest.yaml: a python plugin needs requirements.txt (or pyproject.toml) in the package")


# ---- the package ------------------------------------------------------------------------------------------------
def build_package(plugin_dir: str | Path, out_dir: str | Path) -> Path:
    """Validate plugin_dir and write out_dir/<name>-<version>.difypkg; return its path."""
    root = Path(plugin_dir)
    if not root.is_dir():
        raise PackageError(f"plugin directory {root} does not exist")
    files = collect_files(root)
    manifest = validate_manifest(root, set(files))
    sizes = {f: (root / f).stat().st_size for f in files}
    total = sum(sizes.values())
    if total > MAX_PACKAGE_BYTES:
        largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
        raise PackageError(f"the plugin is {total} bytes unpacked, over the limit of {MAX_PACKAGE_BYTES} bytes; "
                           f"largest files: " + ", ".join(f"{f} ({n} bytes)" for f, n in largest))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{manifest['name']}-{manifest['version']}.difypkg"
    tmp = target.with_suffix(".difypkg.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel in files:
            info = zipfile.ZipInfo(rel, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, (root / rel).read_bytes())
    tmp.replace(target)
    return target


def default_plugin_dir() -> Path:
    """./dify_plugin, else the dify_plugin/ of the checkout this module runs from (an editable install)."""
    for candidate in (Path.cwd() / "dify_plugin", Path(__file__).resolve().parents[1] / "dify_plugin"):
        if (candidate / "manifest.yaml").is_file():
            return candidate
    raise PackageError("cannot find the plugin directory (a dify_plugin/ with manifest.yaml): pass --plugin-dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugin-dir", type=Path, default=None,
                        help="the Dify plugin project (default: ./dify_plugin, else the checkout's dify_plugin/)")
    parser.add_argument("--out-dir", type=Path, default=Path("dist"), help="where the .difypkg goes (default: dist)")


def run(args: argparse.Namespace) -> int:
    """For `kvgate dify-package`: build, print where the package went; PackageError (a ValueError) on failure."""
    target = build_package(args.plugin_dir or default_plugin_dir(), args.out_dir)
    with zipfile.ZipFile(target) as zf:
        count = len(zf.namelist())
    print(f"[kvgate] wrote {target} ({count} files, {target.stat().st_size} bytes)")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `dify-package` subcommand to a CLI's subparsers (its func is `run`)."""
    parser = subparsers.add_parser("dify-package", help="build the Dify plugin package (dist/kvgate-<version>.difypkg)")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate dify-package", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except PackageError as e:
        print(f"kvgate dify-package: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
