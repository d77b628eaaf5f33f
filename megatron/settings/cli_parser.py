"""`FlagParser`: argparse with one-line errors. A mistyped flag prints `error: unrecognized arguments: --train-iter
(did you mean --train-iters?)` and exits with argparse's code 2; the usage text appears only with --help.

Exit code 2 is argparse's (and therefore Megatron's) for a command line it cannot parse; errors found after parsing
(flag combinations, files) exit 1 through `megatron.errors.exit_on_user_error`.
"""
from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

_UNRECOGNIZED = "unrecognized arguments: "


def closest_flags(flag: str, known: list[str], n: int = 3) -> list[str]:
    """The known option strings closest to `flag` ('--train-iter' -> ['--train-iters', ...])."""
    name = flag.split("=", 1)[0]
    long_known = [k for k in known if k.startswith("--")]
    matches = difflib.get_close_matches(name, long_known, n=n, cutoff=0.75)
    prefixed = [k for k in long_known if k.startswith(name) and k not in matches]
    return (matches + sorted(prefixed, key=len))[:n]


class FlagParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line on stderr (with the closest flag names for an unknown flag)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            known = sorted(self._option_string_actions)
            parts = []
            for token in message[len(_UNRECOGNIZED):].split():
                if not token.startswith("-") or token.lstrip("-").replace(".", "").isdigit():
                    continue  # a value of the unknown flag
                close = closest_flags(token, known)
                parts.append(f"{token} (did you mean {' or '.join(close)}?)" if close else token)
            if parts:
                message = _UNRECOGNIZED + ", ".join(parts)
            else:
                message = f"unexpected {message[len(_UNRECOGNIZED):]!s} (positional values are not accepted)"
        self.exit(2, f"error: {message}; see {self.prog} --help\n")

