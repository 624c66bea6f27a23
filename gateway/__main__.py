from gateway.ops.cli import main

raise SystemExit(main())
