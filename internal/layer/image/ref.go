// Package image imports container images from OCI distribution
// registries into the store: each of an image's layers becomes an EROFS
// layer of its own, tagged by its chain ID (its tar's sha256 and those
// of the layers under it, as OCI defines it), so images that share
// their first layers store those once; the image is a small record of
// its layers in order and its config, tagged by its reference.
package image

import (
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"oras.land/oras-go/v2/registry"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
)

// Docker Hub, as image names without a registry mean it.
const (
	dockerHub     = "docker.io"
	dockerHubHost = "registry-1.docker.io"
)

// Reference is an image's place in a registry, normalized as Docker
// normalizes names: python:3.12 is docker.io/library/python:3.12.
type Reference struct {
	Registry   string // host[:port]; docker.io for Docker Hub
	Repository string
	Tag        string // "" when Digest is set
	Digest     digest.Digest
}

// ParseReference reads an image reference: docker://NAME,
// oci://HOST[:PORT]/REPO[:TAG|@DIGEST], or a NAME as docker pull takes
// it. A name without a registry is Docker Hub's, one of a single
// component is under library/, and a missing tag is latest.
func ParseReference(s string) (Reference, error) {
	name, oci := strings.CutPrefix(s, "oci://")
	if !oci {
		name = strings.TrimPrefix(s, "docker://")
	}
	bad := func(why string) (Reference, error) {
		return Reference{}, fmt.Errorf("bad image reference %q: %s (e.g. python:3.12, ghcr.io/org/env:v1 or 127.0.0.1:5000/repo@sha256:...): %w",
			s, why, errdefs.ErrInvalidArgument)
	}
	if name == "" || strings.ContainsAny(name, " \t\n") || strings.Contains(name, "://") || strings.HasSuffix(name, ":") {
		return bad("not an image name")
	}
	first, rest, hasSlash := strings.Cut(name, "/")
	if oci && (!hasSlash || !strings.ContainsAny(first, ".:") && first != "localhost") {
		return bad("an oci:// reference names its registry: oci://HOST[:PORT]/REPO[:TAG]")
	}
	if !oci && (!hasSlash || !strings.ContainsAny(first, ".:") && first != "localhost") {
		// Docker Hub's: a single name is under library/.
		if !hasSlash {
			name = "library/" + name
		}
		name = dockerHub + "/" + name
	} else if first == "index.docker.io" || first == dockerHubHost {
		name = dockerHub + "/" + rest
	}
	r, err := registry.ParseReference(name)
	if err != nil {
		why := strings.TrimPrefix(err.Error(), "invalid reference: ")
		if strings.HasPrefix(why, "invalid repository") && strings.ContainsAny(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") {
			why += ": a repository's name is lowercase"
		}
		return bad(why)
	}
	out := Reference{Registry: r.Registry, Repository: r.Repository}
	if d, err := r.Digest(); err == nil {
		out.Digest = d
	} else {
		out.Tag = r.Reference
		if out.Tag == "" {
			out.Tag = "latest"
		}
	}
	if out.Registry == dockerHub && !strings.Contains(out.Repository, "/") {
		out.Repository = "library/" + out.Repository
	}
	if _, err := out.StoreTag(); err != nil {
		return Reference{}, err
	}
	return out, nil
}

// String is the reference in full: REGISTRY/REPO:TAG or REGISTRY/REPO@DIGEST.
func (r Reference) String() string {
	if r.Digest != "" {
		return r.Registry + "/" + r.Repository + "@" + r.Digest.String()
	}
	return r.Registry + "/" + r.Repository + ":" + r.Tag
}

// Host is the registry's host to speak to (Docker Hub's API host for
// docker.io).
func (r Reference) Host() string {
	if r.Registry == dockerHub {
		return dockerHubHost
	}
	return r.Registry
}

// Loopback says whether the registry is on this host: spoken to over
// plain HTTP, as Docker does.
func (r Reference) Loopback() bool { return remote.Loopback(r.Registry) }

// StoreTag is the tag of the image's record in the store: the reference
// with a port's ':' as '_' (no host name holds one), and a digest as the
// version sha256-HEX.
func (r Reference) StoreTag() (layer.Ref, error) {
	name := strings.Replace(r.Registry, ":", "_", 1) + "/" + r.Repository
	version := r.Tag
	if r.Digest != "" {
		version = r.Digest.Algorithm().String() + "-" + r.Digest.Encoded()
	}
	ref, err := layer.ParseRef(name + ":" + version)
	if err != nil {
		return layer.Ref{}, fmt.Errorf("image %s cannot be named in the store: %w", r, err)
	}
	return ref, nil
}

// LayerTag is the store tag of the EROFS layer converted from an OCI
// layer over those under it, by their chain ID: the same on every host,
// so a layer (and all under it) one image brought is found by the next.
// Its version names the conversion, compressed or not: hosts that share
// a remote and convert differently tag different layers.
func LayerTag(chain digest.Digest, compressed bool) layer.Ref {
	v := conversion
	if compressed {
		v += compressedConversion
	}
	return layer.Ref{Name: "oci/" + chain.Algorithm().String() + "/" + chain.Encoded(), Version: v}
}

// otherConversion is tag, an image layer's, as the other conversion
// names it (compressed for one that is not, and the other way round).
func otherConversion(tag string) string {
	if t, ok := strings.CutSuffix(tag, compressedConversion); ok {
		return t
	}
	return tag + compressedConversion
}

// IsLayerTag says whether a store tag is that of an image's layer.
func IsLayerTag(tag string) bool { return strings.HasPrefix(tag, "oci/sha256/") }

// conversion names how OCI layers become EROFS: a new way gets new tags.
const conversion = "erofs1"

// compressedConversion follows conversion in the tags of layers whose
// files are LZ4-compressed (Options.Compress).
const compressedConversion = "-lz4"
