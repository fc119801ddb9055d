package image

import (
	"encoding/json"
	"fmt"
	"runtime"
	"strings"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
)

// Docker's media types, which registries still serve beside OCI's.
const (
	dockerManifest = "application/vnd.docker.distribution.manifest.v2+json"
	dockerList     = "application/vnd.docker.distribution.manifest.list.v2+json"
	dockerConfig   = "application/vnd.docker.container.image.v1+json"
	dockerLayer    = "application/vnd.docker.image.rootfs.diff.tar.gzip"
	dockerForeign  = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
)

// maxJSON bounds a manifest, an index or a config: a registry's bytes
// are read whole only up to this.
const maxJSON = 4 << 20

// maxLayers bounds an image's layers: Docker's bound is 127, and some
// 200 layers are what a sandbox's overlay can stack (their descriptors'
// paths fill the page its options take), workspaces and snapshots
// over them included.
const maxLayers = 160

func isIndex(mediaType string) bool {
	return mediaType == ocispec.MediaTypeImageIndex || mediaType == dockerList
}

// Platform is os/arch[/variant].
type Platform struct{ OS, Architecture, Variant string }

func (p Platform) String() string {
	s := p.OS + "/" + p.Architecture
	if p.Variant != "" {
		s += "/" + p.Variant
	}
	return s
}

// HostPlatform is linux on this machine's architecture.
func HostPlatform() Platform { return Platform{OS: "linux", Architecture: runtime.GOARCH} }

// ParsePlatform reads os/arch[/variant]; "" is the host's.
func ParsePlatform(s string) (Platform, error) {
	if s == "" {
		return HostPlatform(), nil
	}
	parts := strings.Split(s, "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] == "" || parts[1] == "" {
		return Platform{}, fmt.Errorf("bad platform %q: give OS/ARCH[/VARIANT], e.g. linux/amd64 or linux/arm64/v8", s)
	}
	p := Platform{OS: parts[0], Architecture: parts[1]}
	if len(parts) == 3 {
		p.Variant = parts[2]
	}
	return p, nil
}

// matches says whether an index entry's platform is p. A variant is
// compared only when p names one (arm64's v8 is its only variant).
func (p Platform) matches(q *ocispec.Platform) bool {
	if q == nil || q.OS != p.OS || q.Architecture != p.Architecture {
		return false
	}
	if p.Variant == "" || p.Variant == q.Variant {
		return true
	}
	return p.Architecture == "arm64" && (p.Variant == "v8" && q.Variant == "" || p.Variant == "" && q.Variant == "v8")
}

// parseIndex reads an image index and picks p's manifest in it.
func parseIndex(b []byte, p Platform) (ocispec.Descriptor, error) {
	var idx ocispec.Index
	if err := json.Unmarshal(b, &idx); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("%w: the image index: %v", layer.ErrBadSource, err)
	}
	var have []string
	for _, d := range idx.Manifests {
		if d.Platform == nil {
			continue // an attestation, or a manifest of no platform
		}
		if p.matches(d.Platform) {
			if err := checkDescriptor(d); err != nil {
				return ocispec.Descriptor{}, err
			}
			if d.MediaType != ocispec.MediaTypeImageManifest && d.MediaType != dockerManifest && !isIndex(d.MediaType) {
				return ocispec.Descriptor{}, fmt.Errorf("%w: the index's %s entry is a %q, not an image manifest", layer.ErrBadSource, p, d.MediaType)
			}
			return d, nil
		}
		have = append(have, Platform{d.Platform.OS, d.Platform.Architecture, d.Platform.Variant}.String())
	}
	return ocispec.Descriptor{}, fmt.Errorf("the image has no %s manifest (it has: %s): give --platform one of them: %w",
		p, strings.Join(have, ", "), errNoPlatform)
}

// manifest is what an image manifest says an import needs.
type manifest struct {
	config ocispec.Descriptor
	layers []ocispec.Descriptor
}

// parseManifest reads an image manifest, OCI's or Docker's, and checks
// what it names: a config, and layers a tar stream can be read from.
func parseManifest(b []byte) (manifest, error) {
	var m ocispec.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return manifest{}, fmt.Errorf("%w: the image manifest: %v", layer.ErrBadSource, err)
	}
	if m.SchemaVersion != 2 {
		return manifest{}, fmt.Errorf("%w: the image manifest is of schema version %d, not 2", layer.ErrBadSource, m.SchemaVersion)
	}
	if m.Config.MediaType != ocispec.MediaTypeImageConfig && m.Config.MediaType != dockerConfig {
		return manifest{}, fmt.Errorf("%w: the manifest's config is a %q, not an image config (an artifact, not an image?)", layer.ErrBadSource, m.Config.MediaType)
	}
	if err := checkDescriptor(m.Config); err != nil {
		return manifest{}, err
	}
	if len(m.Layers) == 0 || len(m.Layers) > maxLayers {
		return manifest{}, fmt.Errorf("%w: the image has %d layers: an import takes 1 to %d", layer.ErrBadSource, len(m.Layers), maxLayers)
	}
	for i, l := range m.Layers {
		if err := checkDescriptor(l); err != nil {
			return manifest{}, err
		}
		switch l.MediaType {
		case ocispec.MediaTypeImageLayer, ocispec.MediaTypeImageLayerGzip, ocispec.MediaTypeImageLayerZstd, dockerLayer:
		case ocispec.MediaTypeImageLayerNonDistributable, ocispec.MediaTypeImageLayerNonDistributableGzip, //nolint:staticcheck // still served
			ocispec.MediaTypeImageLayerNonDistributableZstd, dockerForeign: //nolint:staticcheck
			if len(l.URLs) > 0 {
				return manifest{}, fmt.Errorf("%w: layer %d (%s) is fetched from %s, outside the registry: dsec pulls only from registries", layer.ErrBadSource, i, l.Digest, l.URLs[0])
			}
		default:
			return manifest{}, fmt.Errorf("%w: layer %d (%s) is a %q: dsec reads tar layers, plain, gzip or zstd", layer.ErrBadSource, i, l.Digest, l.MediaType)
		}
	}
	return manifest{config: m.Config, layers: m.Layers}, nil
}

// checkDescriptor refuses a descriptor whose digest or size cannot be
// checked.
func checkDescriptor(d ocispec.Descriptor) error {
	if err := d.Digest.Validate(); err != nil || d.Digest.Algorithm() != digest.SHA256 {
		return fmt.Errorf("%w: a descriptor's digest %q is not sha256:HEX", layer.ErrBadSource, d.Digest)
	}
	if d.Size < 0 {
		return fmt.Errorf("%w: %s has a negative size", layer.ErrBadSource, d.Digest)
	}
	return nil
}

// Config is what a sandbox takes from an image's config: the default
// environment, working directory, user and command.
type Config struct {
	Env        []string `json:"env,omitempty"`
	WorkingDir string   `json:"working_dir,omitempty"`
	User       string   `json:"user,omitempty"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
}

// parseConfig reads an image config: its layers' diff IDs (one for each
// of the manifest's n layers) and what a sandbox takes from it.
func parseConfig(b []byte, n int, p Platform) (Config, []digest.Digest, error) {
	var img ocispec.Image
	if err := json.Unmarshal(b, &img); err != nil {
		return Config{}, nil, fmt.Errorf("%w: the image config: %v", layer.ErrBadSource, err)
	}
	if img.OS != "" && img.OS != "linux" {
		return Config{}, nil, fmt.Errorf("%w: the image is for %s, not linux", layer.ErrBadSource, img.OS)
	}
	if img.Architecture != "" && img.Architecture != p.Architecture {
		return Config{}, nil, fmt.Errorf("the image is for %s, not %s: give --platform linux/%s to import it anyway: %w",
			img.Architecture, p.Architecture, img.Architecture, errNoPlatform)
	}
	if len(img.RootFS.DiffIDs) != n {
		return Config{}, nil, fmt.Errorf("%w: the image config lists %d diff IDs for %d layers", layer.ErrBadSource, len(img.RootFS.DiffIDs), n)
	}
	for _, d := range img.RootFS.DiffIDs {
		if err := d.Validate(); err != nil || d.Algorithm() != digest.SHA256 {
			return Config{}, nil, fmt.Errorf("%w: a diff ID %q is not sha256:HEX", layer.ErrBadSource, d)
		}
	}
	c := img.Config
	return Config{Env: c.Env, WorkingDir: c.WorkingDir, User: c.User, Entrypoint: c.Entrypoint, Cmd: c.Cmd}, img.RootFS.DiffIDs, nil
}
