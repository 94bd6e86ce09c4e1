import sys

from kernelize.cli import main

sys.exit(main())
