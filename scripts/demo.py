"""Run the hf_posenc demo on the real SmolLM2-135M: see `python scripts/demo.py --help`."""

from hf_posenc.tools.demo import main

raise SystemExit(main())
