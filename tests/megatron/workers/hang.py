"""Worker for the launcher test: records its pid and session id, then hangs (as a deadlocked rank
would)."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(f"{os.getpid()} {os.getsid(0)}")
time.sleep(600)
