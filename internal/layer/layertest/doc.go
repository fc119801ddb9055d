// Package layertest builds source trees with every kind of entry a layer
// must carry, tar and image archives, and compares trees as the kernel,
// go-erofs and tar see them. The tree helpers need Linux.
package layertest
