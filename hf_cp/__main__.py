import sys

from hf_cp.cli import main

sys.exit(main())
