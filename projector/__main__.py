from projector.ops.cli import main

raise SystemExit(main())
