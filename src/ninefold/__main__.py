import sys

from ninefold.cli.main import main

sys.exit(main())
