"""`python -m vllm_kvq.tools.compare ...`: the command, its children and `report DIR`."""
from vllm_kvq.tools.compare.cli import main

raise SystemExit(main())
