from tuneforge.cli import command

raise SystemExit(command())
