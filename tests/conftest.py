import sys
from pathlib import Path

# The installer is shipped in the sdist, not installed: tests import it from the source tree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
