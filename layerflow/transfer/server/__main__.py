"""`python -m layerflow.transfer.server --config transfer.yaml [--run-dir DIR]`."""

from layerflow.transfer.server.main import main

raise SystemExit(main())
