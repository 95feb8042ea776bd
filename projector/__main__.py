from projector.cli import main

raise SystemExit(main())
