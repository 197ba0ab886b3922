"""The exit codes both binaries (`paraminit`, `paraminit-server`) use, and the table every --help ends with."""

from __future__ import annotations

OK, ERROR, INVALID, FLAGGED, USAGE, INTERRUPTED = 0, 1, 2, 3, 64, 130

SERVER_HELP = f"""exit codes:
  {OK:<4} a clean drain after SIGTERM or Ctrl-C
  {ERROR:<4} the server failed: port in use, a backend that cannot run here, unreadable TLS files
  {USAGE:<4} usage error: unknown flag, a malformed value or variable"""
