"""The command line: the Click group (main.py), one thin module per command (commands/: options -> spec ->
builder -> writer), what several commands share (options, output, launch_options, launch_spec), and the parts of a
command too large for its module (init_setup, plan_model). The only layer that knows Click: it turns a DistsetupError
into its one line and exit status."""
