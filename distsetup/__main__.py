from distsetup.cli import main

main()
