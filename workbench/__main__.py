from workbench.entrypoints.cli import main

raise SystemExit(main())
