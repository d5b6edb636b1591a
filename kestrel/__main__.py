import sys

from kestrel.cli import main

sys.exit(main())
