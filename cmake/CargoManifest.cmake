# Reads what the build needs from Cargo.toml, so that the version lives
# in one place: the package version and the names of the crate's binaries.

# ss_cargo_version(<Cargo.toml> <out-var>): the [package] version, "X.Y.Z".
function(ss_cargo_version manifest out)
  file(STRINGS "${manifest}" lines)
  set(section "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^[ \t]*\\[+([^]]*)\\]+")
      set(section "${CMAKE_MATCH_1}")
    elseif(section STREQUAL "package" AND line MATCHES "^[ \t]*version[ \t]*=[ \t]*\"([0-9]+\\.[0-9]+\\.[0-9]+)[^\"]*\"")
      set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "no [package] version = \"X.Y.Z\" found in ${manifest}")
endfunction()

# ss_cargo_binaries(<crate-dir> <out-var>): the names cargo gives the
# crate's executables: src/main.rs is not used here, so src/bin/<n>.rs,
# src/bin/<n>/main.rs and every [[bin]] name (a [[bin]] whose path is one
# of those files replaces the file's own name, as cargo does).
function(ss_cargo_binaries crate_dir out)
  set(names "")
  set(claimed_paths "")
  file(STRINGS "${crate_dir}/Cargo.toml" lines)
  set(section "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^[ \t]*\\[+([^]]*)\\]+")
      set(section "${CMAKE_MATCH_1}")
    elseif(section STREQUAL "bin" AND line MATCHES "^[ \t]*name[ \t]*=[ \t]*\"([^\"]+)\"")
      list(APPEND names "${CMAKE_MATCH_1}")
    elseif(section STREQUAL "bin" AND line MATCHES "^[ \t]*path[ \t]*=[ \t]*\"([^\"]+)\"")
      list(APPEND claimed_paths "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  file(GLOB files RELATIVE "${crate_dir}" "${crate_dir}/src/bin/*.rs" "${crate_dir}/src/bin/*/main.rs")
  foreach(f IN LISTS files)
    if(f IN_LIST claimed_paths)
      continue()
    endif()
    if(f MATCHES "^src/bin/([^/]+)/main\\.rs$" OR f MATCHES "^src/bin/([^/]+)\\.rs$")
      list(APPEND names "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES names)
  set(${out} "${names}" PARENT_SCOPE)
endfunction()
