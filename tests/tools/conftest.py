"""tools/ is not a package (nothing in cvllm imports it): its scripts are imported here
by putting the folder on sys.path, and run as subprocesses the way a person runs them."""

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
