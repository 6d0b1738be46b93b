"""`python -m layerflow.server --config transfer.yaml [--run-dir DIR]`."""

from layerflow.server.main import main

raise SystemExit(main())
