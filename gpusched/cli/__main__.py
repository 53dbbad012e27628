from gpusched.cli.main import main

main()
