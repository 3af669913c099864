"""The one error a user can fix, and the user's JSON files read into it."""
import json


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""


def read_json(path, what="", detail=False):
    """A JSON file the user named -> its content, or one line: it cannot be read (`what`
    names it: "trace "), or it is not JSON (with the parser's reason where `detail`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read {what}{path}: {e.strerror}")
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not a JSON file" + (f" ({e})" if detail else ""))
