"""Command-line flags that also read PDSPEC_<ROLE>_<FLAG> environment variables.

`--metrics-port` of the decode node is PDSPEC_DECODE_METRICS_PORT; a flag on the command
line wins over the environment, the environment over the default.
"""

from __future__ import annotations

import argparse
import os


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, role: str, **kwargs) -> None:
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)
        self.role = role.upper()

    def env_name(self, flag: str) -> str:
        return f"PDSPEC_{self.role}_{flag.lstrip('-').replace('-', '_').upper()}"

    def add_flag(self, flag: str, *, default=None, type=str, help: str = "", **kwargs):
        """An option whose default comes from the environment when set there."""
        env = self.env_name(flag)
        raw = os.environ.get(env)
        if raw is not None:
            default = raw.lower() in ("1", "true", "yes", "on") if type is bool else type(raw)
        if type is bool:
            return self.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=f"{help} [env {env}]", **kwargs
            )
        return self.add_argument(flag, default=default, type=type, help=f"{help} [env {env}]", **kwargs)
