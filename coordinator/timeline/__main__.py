"""python -m coordinator.timeline report TRACE [--top N] [--plot PNG]"""

import sys

from coordinator.timeline.report import main

sys.exit(main())
