"""Kestrel Studio: fine-tune, watch, chat and export from the browser.

    python app.py [--host H --port P --auth USER:PASSWORD --share --max-upload-mb N]

The studio itself is `kestrel.studio` (`kestrel/studio/launch.py` parses these options).
"""

import sys

from kestrel.studio.launch import main

if __name__ == "__main__":
    sys.exit(main())
