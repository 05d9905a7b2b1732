"""python -m prism serve | demo-model"""

from prism.launch import main

if __name__ == "__main__":
    main()
