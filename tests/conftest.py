import sys
from pathlib import Path

# The installer is shipped in the sdist, not installed: tests import it from the source tree.
# Appended, so an installed cudelta (the GPU machine) wins over the source tree.
sys.path.append(str(Path(__file__).resolve().parent.parent))
