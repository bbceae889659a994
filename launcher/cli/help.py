"""The help layout every subcommand shares."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where the default says something. Options whose default is None or
    False (flags, and values that fall back to the config, which their help names) get nothing,
    instead of a bare "(default: None)" beside the text that explains them."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)
