"""One module per `distsetup` subcommand."""
