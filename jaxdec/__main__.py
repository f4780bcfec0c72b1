from jaxdec.cli import main

raise SystemExit(main())
