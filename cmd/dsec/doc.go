// Command dsec is dsec's command line: layers and images (layer, image),
// sandboxes (run, exec, ps, rm, cp, snap), pools, policies, tokens, and
// the worker that owns the sandboxes (daemon). Built with -tags front it
// is the client alone, which hands a command it lacks to the complete
// binary. Its manual, man/man1/dsec.1 and the pages beside it, is made
// from the commands' help by make docs.
package main
