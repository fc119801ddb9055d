// Package runtime will own sandbox lifecycle: overlay composition of
// layers, the container, fncall, microvm and vm backends, and the host
// worker's API. Nothing is here yet; see the sandboxes issue.
package runtime
