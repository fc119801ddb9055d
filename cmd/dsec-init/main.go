// Command dsec-init is a sandbox's init (pid 1 in its namespaces).
package main

import (
	"fmt"
	"os"

	"github.com/dsec-project/dsec/internal/runtime/container"
)

func main() {
	container.MaybeInit()
	fmt.Fprintln(os.Stderr, "dsec-init: the worker starts this as a sandbox's init; it is not a command")
	os.Exit(2)
}
