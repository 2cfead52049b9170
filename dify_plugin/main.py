"""The plugin's entry point: Dify runs `python -m main` (INSTALL_METHOD picks local, remote or serverless)."""
import os

from dify_plugin import DifyPluginEnv, Plugin

# The SDK's default (300 s) would also close a serverless connection that stays silent that long, so a model's
# own `timeout` credential could never go past it: allow an hour unless the environment says otherwise.
settings = {} if "MAX_REQUEST_TIMEOUT" in os.environ else {"MAX_REQUEST_TIMEOUT": 3600}

if __name__ == "__main__":
    Plugin(DifyPluginEnv(**settings)).run()
