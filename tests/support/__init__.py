"""What the test tiers share: doubles, stand-ins and harnesses.

tests/unit, tests/integration, tests/e2e, tests/bench and tests/soak import from
here and from the code under test, never from each other
(tests/unit/test_test_tiers.py holds that rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

#: The Claude Code CLI double, run as a script (``python3 FAKE_CLAUDE``).
FAKE_CLAUDE: Final = Path(__file__).resolve().with_name("fake_claude.py")
