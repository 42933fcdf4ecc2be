from distsetup.cli.main import main

main()
