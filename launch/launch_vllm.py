"""Drop-in for speculators' ``scripts/launch_vllm.py``, for GDN hybrid models too.

Put this file where speculators' script was and call it the same way:

    python launch_vllm.py MODEL [--hidden-states-path DIR] [--target-layer-ids ID ...] -- VLLM_ARGS

Same options, defaults and layer ids; an unknown option before ``--`` is refused with the
nearest known one, where speculators' script passes it on to vLLM. The work is done by
``vllm_gdn_hs.cli.launch.main`` (also available as ``vllm-gdn-hs launch``), so
vllm-gdn-hs must be installed in the Python that runs this file.
"""

import sys

from vllm_gdn_hs.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
