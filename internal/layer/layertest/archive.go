package layertest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// File is one entry of a tar made by Tar. Type defaults to a regular
// file, or a directory when Name ends in "/".
type File struct {
	Name     string
	Body     string
	Type     byte
	Linkname string
	Mode     int64
	PAX      map[string]string
}

// Tar returns an uncompressed tar of files, in order.
func Tar(files ...File) []byte {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, f := range files {
		h := &tar.Header{Name: f.Name, Mode: f.Mode, ModTime: time.Unix(1700000000, 0), Typeflag: f.Type,
			Linkname: f.Linkname, PAXRecords: f.PAX}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
			if len(f.Name) > 0 && f.Name[len(f.Name)-1] == '/' {
				h.Typeflag, h.Mode = tar.TypeDir, 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(f.Body))
		}
		if f.PAX != nil {
			h.Format = tar.FormatPAX
		}
		if err := tw.WriteHeader(h); err != nil {
			panic(err)
		}
		tw.Write([]byte(f.Body))
	}
	tw.Close()
	return b.Bytes()
}

// Compressed is b as gzip and as zstd.
func Compressed(b []byte) (gzipped, zstded []byte) {
	zs, _ := zstd.NewWriter(nil)
	defer zs.Close()
	return gz(b), zs.EncodeAll(b, nil)
}

func gz(b []byte) []byte {
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	zw.Write(b)
	zw.Close()
	return out.Bytes()
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// DockerArchive returns what `docker save` writes for an image with
// these uncompressed layer tars, bottom first.
func DockerArchive(layers ...[]byte) []byte {
	var files []File
	var paths, diffIDs []string
	for i, l := range layers {
		p := fmt.Sprintf("layer%d/layer.tar", i)
		files = append(files, File{Name: fmt.Sprintf("layer%d/", i)}, File{Name: p, Body: string(l)})
		paths = append(paths, p)
		diffIDs = append(diffIDs, digest.FromBytes(l).String())
	}
	cfg := mustJSON(map[string]any{"architecture": "amd64", "os": "linux",
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs}})
	cfgName := digest.FromBytes(cfg).Encoded() + ".json"
	manifest := mustJSON([]map[string]any{{"Config": cfgName, "RepoTags": []string{"test:latest"}, "Layers": paths}})
	files = append(files, File{Name: cfgName, Body: string(cfg)}, File{Name: "manifest.json", Body: string(manifest)})
	return Tar(files...)
}

// OCIArchive returns a tarred OCI image layout holding one image with
// these layer tars, bottom first, gzip-compressed if compress is set.
func OCIArchive(compress bool, layers ...[]byte) []byte {
	files := []File{{Name: "blobs/"}, {Name: "blobs/sha256/"}}
	blob := func(b []byte) string {
		d := digest.FromBytes(b)
		files = append(files, File{Name: "blobs/sha256/" + d.Encoded(), Body: string(b)})
		return d.String()
	}
	var descs []map[string]any
	var diffIDs []string
	for _, l := range layers {
		mt, body := "application/vnd.oci.image.layer.v1.tar", l
		if compress {
			mt, body = mt+"+gzip", gz(l)
		}
		descs = append(descs, map[string]any{"mediaType": mt, "digest": blob(body), "size": len(body)})
		diffIDs = append(diffIDs, digest.FromBytes(l).String())
	}
	cfg := mustJSON(map[string]any{"architecture": "amd64", "os": "linux",
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs}})
	manifest := mustJSON(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(cfg), "size": len(cfg)},
		"layers": descs})
	md := blob(manifest)
	index := mustJSON(map[string]any{"schemaVersion": 2, "manifests": []map[string]any{{
		"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": len(manifest),
		"platform": map[string]string{"os": "linux", "architecture": "amd64"}}}})
	files = append(files, File{Name: "oci-layout", Body: `{"imageLayoutVersion":"1.0.0"}`}, File{Name: "index.json", Body: string(index)})
	return Tar(files...)
}

// FlattenLayers are three layers that exercise whiteouts, opaque
// directories, replaced files and a hard link whose target an upper
// layer replaces. FlattenWant is what flattening them must give:
// path -> content for files, "dir" for directories.
var FlattenLayers = [][]byte{
	Tar(File{Name: "etc/"}, File{Name: "etc/a", Body: "a1"}, File{Name: "etc/b", Body: "b1"},
		File{Name: "opt/dir/x", Body: "x"}, File{Name: "opt/dir/y", Body: "y"}, File{Name: "keep", Body: "file"},
		File{Name: "hl/target", Body: "orig"}, File{Name: "hl/link", Type: tar.TypeLink, Linkname: "hl/target"},
		File{Name: "usr/bin/tool", Body: "tool"}, File{Name: "usr/lib/libc", Body: "libc"}),
	Tar(File{Name: "etc/.wh.b"}, File{Name: "opt/dir/.wh..wh..opq"}, File{Name: "opt/dir/z", Body: "z"},
		File{Name: "etc/a", Body: "a2"}, File{Name: "hl/target", Body: "new"}),
	Tar(File{Name: "keep/"}, File{Name: "keep/inner", Body: "inner"}, File{Name: "usr/.wh.bin"}),
}

// FlattenWant is the flattened view of FlattenLayers.
var FlattenWant = map[string]string{
	"etc": "dir", "etc/a": "a2", "opt": "dir", "opt/dir": "dir", "opt/dir/z": "z",
	"keep": "dir", "keep/inner": "inner", "hl": "dir", "hl/target": "new", "hl/link": "orig",
	"usr": "dir", "usr/lib": "dir", "usr/lib/libc": "libc",
}
