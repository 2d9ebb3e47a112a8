"""`python -m kvllm.benchmarks.attention`: the same as `kvllm bench attention`."""

import sys

from kvllm.benchmarks.attention.main import main

sys.exit(main())
