from hookline.cli.main import main

main()
