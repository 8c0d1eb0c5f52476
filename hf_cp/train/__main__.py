import sys

from hf_cp.train.launch.entry import main

sys.exit(main())
