"""``python -m vllm_gdn_hs.cli``: the ``vllm-gdn-hs`` command."""

import sys

from vllm_gdn_hs.cli.main import main

sys.exit(main())
