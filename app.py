"""speclab's Gradio lab; on Hugging Face Spaces this file is the app (``app_file: app.py``).

    python app.py                       # http://127.0.0.1:7860, the embedded model family
    python app.py --target PATH --draft PATH --port 7861
    python app.py --allow-custom-models # users may type a local directory / hub id as a model

See ``python app.py --help`` and docs/app.md.
"""

import sys

from speclab.app import main

if __name__ == "__main__":
    sys.exit(main())
