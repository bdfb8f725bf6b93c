"""`python -m duplex ...` is the `duplex` command."""
from duplex.frontend.cli import main

raise SystemExit(main())
