// Package runtime will own sandbox lifecycle: overlay composition of
// layers, the container, fncall, microvm and vm backends, and the host
// worker's API (the sandboxes issue). Its first piece is package
// container, which starts a sandbox's first process in new namespaces on
// a composed root.
package runtime
