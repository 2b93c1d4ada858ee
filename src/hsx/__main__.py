from hsx.cli import main

if __name__ == "__main__":  # vLLM may start processes that re-import the main module
    main()
