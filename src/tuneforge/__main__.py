from tuneforge.cli import main

raise SystemExit(main())
