"""Seconds the newest Ray session's raylet spent between its object store's start and its object
manager's (1.0 where the first connection to the store's socket had to wait for Ray's retry)."""
import glob
import os
import re
import sys
from datetime import datetime

session = max(glob.glob("/tmp/ray/session_2*"))  # the newest start (names carry the start time)
text = open(os.path.join(session, "logs", "raylet.out")).read()


def at(pattern: str) -> float:
    m = re.search(r"\[(\S+ \S+) [^\n]*" + pattern, text)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else float("nan")


print(f"{sys.argv[1]} {at('ObjectManager server started') - at('Plasma store debug dump'):.3f}")
