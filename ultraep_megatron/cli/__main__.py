import sys

from ultraep_megatron.cli import main

sys.exit(main())
