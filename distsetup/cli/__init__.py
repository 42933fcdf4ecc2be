"""The command line: the Click group (main.py), one thin module per command (commands/: options -> spec ->
builder -> writer), and what several commands share (options, output, launch_options). The only layer that
knows Click: it turns a DistsetupError into its one line and exit status."""
