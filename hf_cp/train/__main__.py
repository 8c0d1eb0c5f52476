import sys

from hf_cp.train.launch import main

sys.exit(main())
