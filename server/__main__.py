from servex.server.cli import main

main()
